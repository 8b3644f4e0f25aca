"""The `shardflow` command line: one module per subcommand, registered in `shardflow.cli.main`."""
