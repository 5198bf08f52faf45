#!/usr/bin/env python3
"""Render or lint a chart with Helm's own Go SDK (PyPI helm-python-sdk,
which carries libhelm_c, a C ABI over Helm v4; no helm binary, no network).

stdin: JSON {"op": "render" | "lint", "chart": DIR, "values": {...},
"release": NAME, "namespace": NS, "skip_schema": BOOL, "kube_version": V}
stdout: JSON {"manifests": {template path: text}} or {"lint": report} or
{"error": message} (a render that Helm refused: schema or template `fail`).

skip_schema renders a copy of the chart without values.schema.json, as
`helm template --skip-schema-validation` does, to show the templates' own
checks.
"""

import json
import os
import shutil
import sys
import tempfile

import helm_python as helm


def main() -> int:
    job = json.load(sys.stdin)
    chart = job["chart"]
    with tempfile.TemporaryDirectory() as tmp:
        if job.get("skip_schema"):
            copy = os.path.join(tmp, os.path.basename(chart))
            shutil.copytree(
                chart, copy, ignore=shutil.ignore_patterns("values.schema.json")
            )
            chart = copy
        if job["op"] == "lint":
            report = helm.lint(
                chart,
                job["values"],
                strict=True,
                namespace=job["namespace"],
                kube_version=job.get("kube_version"),
            )
            out = {"lint": report}
        else:
            try:
                manifests = helm.Chart.load(chart).render(
                    job["values"],
                    name=job["release"],
                    namespace=job["namespace"],
                    is_install=True,
                )
                out = {"manifests": manifests}
            except helm.HelmError as e:
                out = {"error": f"{type(e).__name__}: {e}"}
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
