"""The cuda-ipc fabric: device memory of ranks on one host, moved by device copies (see README.md)."""
