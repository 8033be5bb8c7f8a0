"""The cluster: the Ray session, worker placement, and cluster jobs."""
