"""Make a private CA and a SuperLink server certificate (SAN: the given names and IPs).

    python scripts/make_certs.py --out certs --host aggregator.local --host 192.168.1.10

Writes ca.crt (give it to every client machine), server.pem and server.key (keep them on the
aggregator). One certificate covers the gRPC Fleet API and the HTTPS Control API.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from car_fl.deploy.certs import make_certificates, make_node_key


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("certs"))
    parser.add_argument(
        "--host",
        action="append",
        required=True,
        help="host name or IP of the SuperLink (repeat for each)",
    )
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument(
        "--node-keys",
        type=int,
        default=0,
        help="also make this many SuperNode key pairs (node authentication)",
    )
    args = parser.parse_args()
    files = make_certificates(args.out, args.host, days=args.days)
    print(f"CA: {files.ca_cert}\nserver certificate: {files.server_cert}\nkey: {files.server_key}")
    for i in range(args.node_keys):
        private, public = make_node_key(args.out / f"node{i}.key")
        print(f"SuperNode {i} key: {private} (public: {public})")


if __name__ == "__main__":
    main()
