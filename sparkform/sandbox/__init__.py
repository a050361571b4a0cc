"""The sandbox: a disposable Debian host with systemd as PID 1 (systemd-nspawn, own network
namespace, reached over SSH), a fake Hugging Face hub serving tiny checkpoints, and an offline
wheelhouse of vLLM's CPU build, so a deploy can be rehearsed for real before it touches a Spark.
"""
