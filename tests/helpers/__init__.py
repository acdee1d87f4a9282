"""What tests share that is not a fixture: starting real processes (nats-server,
kvcache, the mesh, the deployment harness), tiny models saved by transformers or
made here, certificates, a hand-moved clock, metric scrapers, NATS clients, the
Helm chart rendered without a cluster, network namespaces as hosts, and the
numbers tests judge by. Test modules import from here, never from one another or
from a conftest; fixtures live in the conftest.py files."""
