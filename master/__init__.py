"""The master: OpenAI-compatible API, node registry, routing, request relay, admin API, metrics.

Start it with :func:`master.server.run_master`; build the app in tests with
:func:`master.server.create_app`. One module per job: ``config`` (settings), ``openai_api`` and
``openai_schemas`` (HTTP surface), ``node_ws`` and ``registry`` (nodes), ``routing`` and
``prefix_index`` (where a request goes), ``relay`` (a request's life), ``admin``, ``metrics``.
"""
