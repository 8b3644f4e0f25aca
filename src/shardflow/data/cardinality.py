"""The counts that `Dataset.cardinality()` returns besides a number of elements. Each source and transformation
computes its count from its definition, without iterating, by tf.data's rule for it, in its `_cardinality()`."""

from __future__ import annotations

INFINITE_CARDINALITY = -1
"""The count of a dataset that never ends (`repeat()`, `counter()`)."""
UNKNOWN_CARDINALITY = -2
"""The count of a dataset whose size depends on the data (`filter`, `flat_map`, file sources)."""
