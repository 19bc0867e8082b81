"""handoff_proxy: `handoff proxy`, an OpenAI-compatible frontend for vLLM P/D under handoff.

A client's completion or chat request becomes one handoff: the proxy picks a
prefill and a decode engine, starts the handoff on the coordinator, sends the
prompt to the prefill (one token, KV held), then to the decode with the
prefill's ``kv_transfer_params``, and streams the decode's answer back. The
engines' KV connector (HandoffConnector) reports to the coordinator; the
proxy only starts, watches and cancels. docs/proxy.md is the guide.

Which module owns what:

- ``config``: the ``handoff proxy`` flags, checked into a ``ProxyConfig``.
- ``pairs``: which prefill and which decode engine take the next request.
- ``errors``: what went wrong, as an HTTP status and an OpenAI-style error body.
- ``flow``: one request's handoff: start, the two legs, watching, canceling.
- ``app``: the aiohttp application (routes, streaming) and its process.
- ``metrics``: the ``handoff_proxy_*`` metrics.

Built on aiohttp, for its server and its client in one async stack on one
event loop: a client that disconnects cancels its handler, which closes the
engine leg it has open, with no thread or second framework in between; and
it is well kept (releases every few weeks, typed, long in production use).
Imported only by ``handoff proxy``: ``handoff --help`` works without the
``[proxy]`` extra.
"""
