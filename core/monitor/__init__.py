"""Monitoring: incremental log readers, series, health warnings and failure diagnosis (NVML: core.gpu)."""
