"""Fault tolerance: checkpoints, preemption, in-process elastic recovery.

Public names are re-exported by :mod:`hvdkit` (``hvdkit.Checkpointer``,
``hvdkit.elastic``, ``hvdkit.preemption``). The modules, top-down::

    checkpoint.py             Checkpointer: saves and restores the whole training state
      _save_schedule.py       when it saves (every N steps, every T s by rank 0's clock)
      _background_write.py    rank 0 writes in a thread while training goes on
      _checkpoint_files.py    the on-disk format (atomic, checksummed folders)
      _checkpoint_read.py     restore's search: the newest checkpoint that loads
      _training_state.py      step, epoch, extras, random state, the sampler's place
      _preemption_stop.py     SIGTERM: save the agreed step, then every rank leaves
      _checkpoint_callback.py the Keras callback counting steps for the schedule
    preemption.py             the SIGTERM watch and the per-second step exchange
    elastic.py                hvdkit.elastic.run: train on after a lost peer or a newcomer
      _next_world.py          the one loop: on a lost peer, join the next world, try again
      _memory_commit.py       the last commit in memory, what a new world rolls back to
      _failed_attempt.py      what a failed attempt leaves behind, let go of safely
    elastic_state.py          Horovod's state classes (KerasState, ...) over the above
"""
