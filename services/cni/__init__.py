"""palisade-cni: the CNI plugin that joins pods a container runtime creates to the node's datapath."""
