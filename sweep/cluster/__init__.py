"""The cluster: the Ray session, the pool of worker actors work is dispatched to, worker placement, and cluster
jobs."""
