"""A Megatron-Core script written by hand (``original.py``) and the same script converted to
the trainer library (``converted.py``), as docs/trainer-library.md ("Converting a Megatron-Core
script") says; tests/trainer/test_conversion.py runs both and checks the guide's counts."""
