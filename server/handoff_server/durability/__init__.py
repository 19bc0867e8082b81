"""Durability: accepted calls kept in SQLite, and the registry rebuilt from them.

- ``journal``: the SQLite file: group commit, the durability barrier the
  servicer awaits before it writes, compaction, locking.
- ``records``: the record format: what each accepted call is as JSON, and the
  recorder the registry hands calls to.
- ``recovery``: crash recovery: replaying a journal into a registry on start.
- ``rebuild``: an unfinished handoff rebuilt through the core alone (recovery's fast path).
"""
