"""The domain: a handoff's vocabulary, its state machine, and the handoff table.

Synchronous and clock-injected (no awaits, so each call is atomic; ``core``
is also pure: no I/O, no clock).

- ``model``: the vocabulary, every word once: roles, orders, facts, actions,
  outcomes, releases, errors.
- ``core``: the state machine of one handoff; every transition is there.
- ``authorization``: who may report what (which role proves which fact).
- ``packing``: a completed handoff packed into a few words for retention.
- ``entries``: what the registry keeps per unfinished handoff, and the
  bookkeeping after the core accepted a call (shared with recovery's rebuild).
- ``retained``: a completed handoff as the registry keeps it, a plain record
  the garbage collector need not walk, read back as a ``Retained``.
- ``retention``: finished handoffs kept for a while, expired and evicted oldest first.
- ``timers``: the timer heap and the kinds of timer the server sets.
- ``delivery``: an issued action until its engine acknowledges it: queues,
  redelivery, streams that drop, incarnations and fencing.
- ``registry``: the handoff table and the one path every call takes; what
  each timer does; lost engines; its replay mode for recovery.
"""
