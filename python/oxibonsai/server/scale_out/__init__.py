"""Scale-out on Ray Serve: many ``AsyncLLM`` replicas behind one OpenAI endpoint, routed by cached
prefix. ``app.build_ray_app`` builds the Serve application: one ingress deployment serving the same
FastAPI app as ``oxibonsai serve`` (``server.api_server.build_app`` over a ``remote.RemoteEngine``, so
routes, errors and streaming are shared code), N ``replica.EngineReplica`` deployments, each an
``AsyncLLM``, and ``router.PrefixAffinityRouter``, which hashes each request's token ids into 16-token
blocks as the Rust prefix trie does and sends it to the replica most likely to hold its longest prefix.
Replicas publish their metrics to ``board.MetricsBoard``, which the ingress's ``/metrics`` merges with
a ``replica`` label. Ray is imported only here (``pip install 'oxibonsai[ray]'``)."""
