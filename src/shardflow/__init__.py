"""shardflow: parameter-server training, input pipelines and a cluster-wide profiler for PyTorch."""
