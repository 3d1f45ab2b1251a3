"""IPAM and identities: numeric identities, pod IPs and the ipcache, backed by etcd."""
