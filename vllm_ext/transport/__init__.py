"""The weight transport: how a trainer's weights reach vLLM replicas, with no vLLM in it.

Both ends import it: the trainer side (``rl_loop.trainer``, ``rl_loop.orchestrator``)
to send, the receiver's vLLM adapter (``vllm_ext.weights``) to receive. It imports
nothing of vLLM and nothing of the rest of the project, so the trainer never loads
vLLM to publish a version (``tests/unit/test_import_graph.py`` holds it to that).

Pieces, by file, each importing only those listed before it:

* ``format.py``: what every transport shares: ``TensorMeta`` (name, dtype, shape),
  the one error type ``WeightUpdateError``, checksums (xxh3-64) and the check of an
  update against the served model's layout;
* ``wire.py``: the filesystem transport, both ends (safetensors shards +
  ``moerl_commit.json`` with checksums, written last);
* ``shm.py``: the same-host shared-memory ring that carries a streamed update's bytes
  when sender and receiver share a host;
* ``te.py``: the Mooncake Transfer Engine lane (RDMA), slots and hashes as the ring's;
* ``channel.py``: the TCPStore handshake and gloo process groups between a sender and
  its receivers, kept across updates;
* ``stream.py``: the streaming transport over torch.distributed, both ends (control on
  ``channel.py``, bytes through ``shm.py``, ``te.py`` or gloo broadcasts);
* ``peak_rss.py``: the peak resident memory of a stretch of work (the bound a sharded
  update promises, logged by the receiver and held to in a test);
* ``plan.py`` and ``sharded.py``: the resharding plan (which trainer rank sends which
  box to which replica worker, experts stacked on the wire) and the sharded transport
  that carries it;
* ``client.py``: the trainer-side driver of an update over HTTP (stdlib only):
  pause(keep) -> start -> update -> finish(version) -> resume, for one or many replicas;
  on the sharded lanes the bytes first, while the replicas serve, then one swap request.
"""
