"""`tandem train-adapter`: distils HAT's draft adapter from the LLM's own answers."""
