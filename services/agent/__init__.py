"""One per node: supervises trainer processes, detects failures, talks to the coordinator."""
