#!/usr/bin/env python3
"""Dial a Unix socket as the kubelet does, with the real gRPC C-core client
(Python grpcio), and make unary calls with bytes the Rust caller serialized
(`dra_kubeletplugin::testing::grpcio_calls` runs it with `python3 -c`).

The kubelet's plugin watcher dials `<name>-reg.sock` with grpc-go, passing
the bare socket path as target and no WithAuthority, so grpc-go sends the
path percent-encoded as HTTP/2 `:authority` (older grpc-go: the raw path);
the DRA socket is dialed as `unix:<path>`, which sends `localhost`
(carve: shared/reference/node-contracts.md section 1). grpcio reproduces each
with `grpc.default_authority`.

stdin: JSON {"socket": PATH, "authority": STR, "calls": [{"method":
"/pkg.Service/Method", "request": HEX, "timeout": SECONDS}]}
stdout: JSON list, one {"ok": HEX} or {"code": NAME, "details": STR} a call.
All calls share one channel (one HTTP/2 connection), as the kubelet's do.
"""

import json
import sys

import grpc


def main() -> int:
    job = json.load(sys.stdin)
    options = [("grpc.default_authority", job["authority"])]
    out = []
    with grpc.insecure_channel("unix://" + job["socket"], options=options) as ch:
        for call in job["calls"]:
            # No serializers: requests and responses are raw protobuf bytes.
            rpc = ch.unary_unary(call["method"])
            try:
                resp = rpc(bytes.fromhex(call["request"]), timeout=call["timeout"])
                out.append({"ok": resp.hex()})
            except grpc.RpcError as e:
                out.append({"code": e.code().name, "details": e.details() or ""})
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
