"""`tandem profile`: this device half and a HAT worker measured, acceptance replayed offline (main.py)."""
