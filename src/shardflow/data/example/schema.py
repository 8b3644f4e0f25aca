"""Infer the schema of serialized tf.train.Example records: each feature's kind and how many values it has."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from shardflow.data.example import example_pb2

_KIND_NAMES = {"bytes_list": "bytes", "float_list": "float", "int64_list": "int64"}


@dataclass
class FeatureStats:
    """What the records seen so far hold under one feature name."""

    kinds: set[str] = field(default_factory=set)
    """"bytes", "float" and/or "int64" (more than one means the records disagree)."""
    num_records: int = 0
    """Records that have the feature."""
    min_length: int = 0
    max_length: int = 0


@dataclass
class ExampleSchema:
    """Feature statistics over many records; records that are not Examples are counted, not described."""

    features: dict[str, FeatureStats] = field(default_factory=dict)
    num_records: int = 0
    num_not_examples: int = 0

    def add(self, records: Iterable[bytes]) -> None:
        for record in records:
            self.num_records += 1
            try:
                feature_map = example_pb2.Example.FromString(record).features.feature
            except DecodeError:
                self.num_not_examples += 1
                continue
            for name, feature in feature_map.items():
                kind = feature.WhichOneof("kind")
                if kind is None:
                    continue  # parse_example treats a feature with no list as missing
                length = len(getattr(feature, kind).value)
                stats = self.features.get(name)
                if stats is None:
                    stats = self.features[name] = FeatureStats(min_length=length, max_length=length)
                stats.kinds.add(_KIND_NAMES[kind])
                stats.num_records += 1
                stats.min_length = min(stats.min_length, length)
                stats.max_length = max(stats.max_length, length)
