"""Peer: TensorFlow ParameterServerStrategy on localhost, W workers and P PS, the click-through model of
click_model.py: the 10M-row item table sharded over the PS (the strategy's variable partitioner), Adagrad, batch 512.

Usage: python tf_embedding.py RESULT_JSON WORKERS PS STEPS
Writes steps/s after STEPS timed steps (each one batch of 512 on one worker), and the number of shards of the item
table.

Keras 3's Adagrad updates a sparse gradient with sqrt over the whole accumulator (10M x 16) at every step, so each
step costs what a dense update of the table does; the peer applies TensorFlow's sparse Adagrad kernel instead
(ResourceSparseApplyAdagradV2 on the rows of the de-duplicated gradient, as TensorFlow's own v1 optimizer does),
on the PS that holds the variable: TensorFlow at its best here.
"""

import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["GRPC_FAIL_FAST"] = "use_caller"

import click_model as cm
from tf_ps import start_servers

WARMUP = 30


def build(tf) -> tuple[dict, list, list]:
    """The tables and the head's layers, and each trainable variable (a shard of the item table is one) with its
    Adagrad accumulator, on the same PS."""

    def uniform(shape):
        def initial_value(partition_shape=None, partition_offset=None):
            return tf.random.uniform(partition_shape or shape, cm.INIT_LOW, cm.INIT_HIGH, seed=0)

        return tf.Variable(initial_value, shape=shape, dtype=tf.float32)

    tables = {
        "item": uniform((cm.NUM_ITEMS, cm.ITEM_DIM)),
        "category": uniform((cm.NUM_CATEGORIES, cm.CATEGORY_DIM)),
        "tags": uniform((cm.NUM_TAGS, cm.TAG_DIM)),
    }
    widths = (cm.WIDTH, *cm.HIDDEN, 1)
    layers = [
        (tf.Variable(tf.random.uniform((width_in, width_out), -limit, limit, seed=0)), tf.Variable(tf.zeros(width_out)))
        for width_in, width_out in itertools.pairwise(widths)
        for limit in [(6 / (width_in + width_out)) ** 0.5]  # Glorot's
    ]
    variables = [*shards(tables["item"]), tables["category"], tables["tags"], *(v for layer in layers for v in layer)]
    accumulators = []
    for variable in variables:
        with tf.distribute.get_strategy().extended.colocate_vars_with(variable):
            accumulators.append(
                tf.Variable(lambda v=variable: tf.fill(v.shape, cm.INITIAL_ACCUMULATOR), trainable=False)
            )
    return {"tables": tables, "layers": layers}, variables, accumulators


def shards(table):
    """The variables a table is cut into: a ShardedVariable's, or the table itself where one PS holds it whole."""
    try:
        return list(table.variables)
    except AttributeError:
        return [table]


def main() -> None:
    result_path, num_workers, num_ps, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cluster, servers = start_servers(num_workers, num_ps)
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    # Variables over 64 MB are cut into one shard per PS; the others are placed whole, round-robin.
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(64 << 20, max_shards=num_ps)
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model, variables, accumulators = build(tf)

    def dataset_fn():
        log = {key: value.reshape(cm.NUM_BATCHES, cm.BATCH, *value.shape[1:]) for key, value in cm.click_log(0).items()}
        return tf.data.Dataset.from_tensor_slices(log).repeat().prefetch(2)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def forward(batch):
        tables = model["tables"]
        x = tf.concat(
            [
                tf.nn.embedding_lookup(tables["item"], batch["item"]),
                tf.nn.embedding_lookup(tables["category"], batch["category"]),
                tf.reduce_mean(tf.nn.embedding_lookup(tables["tags"], batch["tags"]), axis=1),
                batch["dense"],
            ],
            axis=1,
        )
        for i, (weight, bias) in enumerate(model["layers"]):
            x = tf.matmul(x, weight) + bias
            x = tf.nn.relu(x) if i + 1 < len(model["layers"]) else x
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(batch["click"], tf.squeeze(x, 1)))

    def apply(variable, accumulator, grad):
        if isinstance(grad, tf.IndexedSlices):
            rows, position = tf.unique(grad.indices)
            summed = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(rows)[0])
            tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=variable.handle, accum=accumulator.handle, lr=cm.LR, epsilon=cm.EPS, grad=summed, indices=rows
            )
        else:
            tf.raw_ops.ResourceApplyAdagradV2(
                var=variable.handle, accum=accumulator.handle, lr=cm.LR, epsilon=cm.EPS, grad=grad
            )

    @tf.function
    def step(it):
        def replica(batch):
            with tf.GradientTape() as tape:
                loss = forward(batch)
            for variable, accumulator, grad in zip(
                variables, accumulators, tape.gradient(loss, variables), strict=True
            ):
                apply(variable, accumulator, grad)
            return loss

        return strategy.run(replica, args=(next(it),))

    for _ in range(WARMUP):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    started = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    elapsed = time.perf_counter() - started
    with open(result_path, "w") as f:
        json.dump({"steps_per_s": steps / elapsed, "item_shards": len(shards(model["tables"]["item"]))}, f)
    for p in servers:
        p.kill()
    os._exit(0)


if __name__ == "__main__":
    main()
