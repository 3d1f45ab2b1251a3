"""The per-node datapath: BPF programs and maps enforcing ordered policy entries."""
