"""Tests of the serving side: sampling, chat I/O, the engine, the offline API, the HTTP server and
multi-host serving."""
