"""Durability: accepted calls kept in SQLite, and the registry rebuilt from them.

- ``journal``: the SQLite file: group commit, the durability barrier the
  servicer awaits before it writes, compaction, locking.
- ``statedir``: the state dir checked before the journal opens it, and what
  to say (naming --state-dir) when it cannot be used.
- ``statelock``: the state dir held by one server (an OS-level lock), 0700.
- ``torn``: a WAL torn by a crash, said before SQLite drops it.
- ``space``: new handoffs refused while the journal's volume is short of room.
- ``holders``: which process holds the journal's write lock.
- ``records``: the record format: what each accepted call is as JSON, and the
  recorder the registry hands calls to.
- ``recovery``: crash recovery: replaying a journal into a registry on start.
- ``rebuild``: an unfinished handoff rebuilt through the core alone (recovery's fast path).
"""
