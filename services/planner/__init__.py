"""The planner: sizes and places every job by the cost model of DESIGN.md section 3 (CP-SAT)."""
