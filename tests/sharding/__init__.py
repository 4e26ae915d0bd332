"""Tests of sharding/ and of the model on meshes of 16 fake CPU devices, and multi-process start-up."""
