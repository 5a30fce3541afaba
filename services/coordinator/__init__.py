"""Control plane: job API, node registry, reconcile loop; state in Redis."""
