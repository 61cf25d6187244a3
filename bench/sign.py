"""Signing and verification cost, measured side by side in one run: weightship versus model_signing.

A model of ``--files`` files totalling ``--size-mb`` MiB is written, and its manifest built as
``weightship publish`` does (``hash_seconds``: reading and hashing every byte once). Then, on the
same model and key:

- **weightship** signs the statement built from the manifest's digests (``sign_seconds``) and a
  node verifies a signature against its policy (``verify_seconds``): neither reads a byte of the
  model, so both grow with the number of files, not their size;
- **model_signing** signs and verifies the directory (``model_signing_sign_seconds``,
  ``model_signing_verify_seconds``), hashing every byte each time.

``publish_overhead`` is the time signing adds to a publish, as a fraction of the publish's
hashing; ``first_byte_overhead_seconds`` what a node's check adds before its first byte
(``verify_seconds``; one request for the signatures comes on top). The chunk hashes, checked as
bytes arrive, still guard the bytes.

Usage: python bench/sign.py [--files 1000] [--size-mb 10240] [--repeat 3]
Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from model_signing import hashing as ms_hashing
from model_signing import signing as ms_signing
from model_signing import verifying as ms_verifying

from weightship.manifest import SIGNATURE_FILE, build_manifest
from weightship.signing import check_version, sign_manifest
from weightship.signing_policy import KeyTrust, ModelPolicy


def _write_model(root: Path, files: int, total: int) -> None:
    block = os.urandom(4 * 1024 * 1024)
    per = max(1, total // files)
    for i in range(files):
        sub = root / f"part-{i // 100:02d}"
        sub.mkdir(exist_ok=True)
        with open(sub / f"shard-{i:05d}.bin.data", "wb") as handle:
            left = per
            while left > 0:
                n = min(left, len(block))
                handle.write(block[i % 7 : i % 7 + n] if n + 7 <= len(block) else block[:n])
                left -= n


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--size-mb", type=float, default=10240)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    total = int(args.size_mb * 1024 * 1024)

    with tempfile.TemporaryDirectory(prefix="ws-bench-sign-") as tmp:
        keys = Path(tmp) / "keys"
        keys.mkdir()
        private = ec.generate_private_key(ec.SECP256R1())
        key_file, public_file = keys / "signing.key", keys / "signing.pub"
        key_file.write_bytes(
            private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        public_file.write_bytes(
            private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        model = Path(tmp) / "bench-model"
        model.mkdir()
        _write_model(model, args.files, total)

        started = time.perf_counter()
        manifest = build_manifest(model, "bench-model")
        hash_seconds = time.perf_counter() - started
        policy = ModelPolicy(model="bench-model", require_signature=True, keys=(KeyTrust("bench", private.public_key()),))
        pem = key_file.read_bytes()
        bundle = sign_manifest(manifest, pem)
        sign_seconds = _best(lambda: sign_manifest(manifest, pem), args.repeat)
        assert check_version(manifest, [bundle], policy).accepted
        verify_seconds = _best(lambda: check_version(manifest, [bundle], policy), args.repeat)

        signature = Path(tmp) / SIGNATURE_FILE  # beside the model, as model_signing writes it by default
        hashing = ms_hashing.Config()  # type: ignore[no-untyped-call]  # the library's constructors are unannotated
        signer = ms_signing.Config().use_elliptic_key_signer(private_key=key_file).set_hashing_config(hashing)  # type: ignore[no-untyped-call]
        ms_sign = _best(lambda: signer.sign(model, signature), args.repeat)
        verifier = ms_verifying.Config().use_elliptic_key_verifier(public_key=public_file)  # type: ignore[no-untyped-call]
        ms_verify = _best(lambda: verifier.verify(model, signature), args.repeat)

    publish_overhead = sign_seconds / hash_seconds if hash_seconds > 0 else 0.0
    print(f"model: {args.files} files, {total / 2**30:.2f} GiB; publish hashing {hash_seconds:.2f}s")
    print(f"sign:   weightship {sign_seconds * 1000:9.1f} ms   model_signing {ms_sign * 1000:9.1f} ms   "
          f"x{ms_sign / sign_seconds:.0f}")  # fmt: skip
    print(f"verify: weightship {verify_seconds * 1000:9.1f} ms   model_signing {ms_verify * 1000:9.1f} ms   "
          f"x{ms_verify / verify_seconds:.0f}")  # fmt: skip
    print(f"publish overhead: {publish_overhead * 100:.3f}% of hashing; node first byte: +{verify_seconds * 1000:.1f} ms")
    result = {
        "files": args.files,
        "bytes": total,
        "cpu": platform.processor() or platform.machine(),
        "hash_seconds": round(hash_seconds, 4),
        "sign_seconds": round(sign_seconds, 6),
        "verify_seconds": round(verify_seconds, 6),
        "model_signing_sign_seconds": round(ms_sign, 4),
        "model_signing_verify_seconds": round(ms_verify, 4),
        "verify_speedup": round(ms_verify / verify_seconds, 1),
        "publish_overhead": round(publish_overhead, 6),
        "first_byte_overhead_seconds": round(verify_seconds, 6),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
