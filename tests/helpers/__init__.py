"""What the tests share: fixture builders, the CLI runner, artifact editing, the fuzzer's parts.

Test modules import from here, never from one another (tests/test_layering.py checks).
"""
