"""ember-cupy on Ray Serve: N engine replicas behind one OpenAI endpoint (`pip install ember-cupy[ray]`).

- replica.py: the engine deployment, one AsyncEngine per replica, generate/abort over Ray.
- remote_engine.py: what the project's own HTTP app (ember_cupy.server) sees as its engine in the
  ingress: admission and streams forwarded to replicas through a deployment handle.
- ingress.py: the OpenAI ingress deployment, the project's aiohttp app behind Serve's HTTP proxy;
  in_process_app.py / response_capture.py: that app called in process with Serve's starlette requests.
- routing_key.py / prefix_router.py / round_robin_router.py: prefix-aware replica choice
  (and the round-robin baseline it is measured against).
- app.py: the application builder (`serve run ember_cupy.ray_serve.app:build`), cli.py: the
  `ember-cupy serve --data-parallel-backend ray` entry.

Importing this package needs ray[serve]; nothing else in ember_cupy imports it.
"""
