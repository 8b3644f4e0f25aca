"""`python -m shardflow` runs the command-line tool."""

from shardflow.cli.main import main

raise SystemExit(main())
