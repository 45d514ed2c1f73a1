"""Sharded datasets: WebDataset tar shards written once (``fastvision data shard``), read as a
map-style dataset from a folder or over HTTP, in a shard-aware order of (seed, epoch).

Modules: :mod:`.tario` (deterministic tar bytes, member tables), :mod:`.store` (the index, local
files and the HTTP cache), :mod:`.writer` (the shard writer), :mod:`.reader` (random access and
the shard-aware order), :mod:`.tfrecord` (DLE's TFRecords without TensorFlow). The readers of the
dataset formats live with the formats: :mod:`fastvision.data.formats.shards` (ImageFolder / COCO
items from shards) and :mod:`fastvision.data.formats.shard_sets` (``--data OUT`` recognised by the
format builders). See docs/pipelines.md, "Sharded datasets".
"""
