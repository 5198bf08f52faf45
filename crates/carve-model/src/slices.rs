//! ResourceSlices a node publishes (built and validated here, sent by carve-kube).
