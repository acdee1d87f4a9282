"""The deploy tier (marker `deploy`): the compose file, the Helm chart, the Dockerfile
and the mesh started as they start it, checked without a cluster or a Docker engine,
and `infermesh up`'s errors."""
