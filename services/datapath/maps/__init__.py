"""One module per BPF map: the ctypes layout of its key and value (mirroring the C
structs in ``bpf/palisade.c``) and the only place where byte order is converted."""
