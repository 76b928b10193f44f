"""Behaviour suites that span modules: what must hold whatever module implements it.

``test_public_api`` pins the public names and signatures; ``test_no_bad_update`` and
``test_state_paths``: no path applies a bad update; ``test_recipes_api``: PyTorch
AMP recipes; ``test_fault_injection``: faults injected into training loops;
``test_first_hour_errors``: the errors a new user meets say what to write.
"""
