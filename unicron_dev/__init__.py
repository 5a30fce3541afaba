"""Development tooling, not shipped in the image: the local cluster of real processes that the
demo, the end-to-end tests and the benches run on, and fakes behind the services' interfaces.
It may import anything; nothing in ``unicron/`` or ``services/`` imports it."""
