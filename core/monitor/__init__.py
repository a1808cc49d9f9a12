"""Monitoring: NVML, incremental log readers, series, health warnings and failure diagnosis."""
