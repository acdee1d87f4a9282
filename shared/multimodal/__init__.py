"""Images of requests, torch-free (the balancer loads them before dispatch): where an
image comes from (a ``data:`` URL or an http(s) download behind an address policy),
its decoding to RGB pixels under a pixel limit, and its identity, a 256-bit hash.

One job per file: ``errors.py`` (why an image is refused, with the request field it
came from), ``image.py`` (what is asked for and what is loaded), ``data_url.py``,
``address.py`` (which hosts may be fetched), ``fetch.py``, ``decode.py``,
``identity.py`` and ``loader.py`` (a request's images, loaded concurrently)."""
