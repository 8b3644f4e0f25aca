"""Checkpoints, in one wing: the store (store.py: the files in model_dir, the only reader and writer of
`manifest.json` and `latest`), what a checkpoint holds (model_state.py) and how the chief sends it to and fetches
it from the PS (servers.py), when the chief checkpoints (manager.py) and how a job restores (restore.py).

It sits in `train/` because it needs the PS client and the job's config: `ps` and `cluster` are below it and never
import it, and neither do `data`, `profile` or `comm`. The PS's own copy of its shard between a snapshot and the
chief's save stays in ps/state.py, below. Import the modules themselves; this package re-exports nothing, so that
importing the store (as the evaluator does) loads no more than the store."""
