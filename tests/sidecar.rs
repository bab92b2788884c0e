//! End-to-end tests of the `mmrouter-sidecar` binary (written next).
