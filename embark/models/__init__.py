"""DLRM models (dot interaction and DCNv2) and the workload presets they are built from."""
