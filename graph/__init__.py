"""The error-code catalog and the networkx topology built from it."""
