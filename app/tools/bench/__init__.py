"""`tandem bench ...`: benchmarks against real servers, and the DiSCo trace simulator."""
