"""The HTTP front on aiohttp: the app factory, the routes, the protocol middleware, the
connection handler (header and body read timeouts), JSON responses, the 422 errors the routes
build, and the one module that touches aiohttp's private attributes.

It owns everything that knows HTTP: status codes, headers, request parsing and response
bodies on the wire. It may import ``protocol``, ``state``, ``execution``, ``observability`` and
the shared top-level modules; nothing below it imports aiohttp (import-linter checks both).
"""
