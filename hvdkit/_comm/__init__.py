"""How hvdkit's processes talk, under the collectives: internals, no public API.

progress markers (``progress``, ``graph_progress``), Horovod op names (``op_names``),
gradient buckets (``buckets``) and their compression (``compression``, Horovod's
``Compression``), the background threads' priorities (``threads``,
``priority_trial``), a process's TCP connections (``sockets``) and the files a worker
and its rank share in an elastic job (``meeting``).
"""
