"""Starting pdcluster processes: on this machine, across nodes, and one replica on loopback."""
