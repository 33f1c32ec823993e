"""`manage.py first_admin [--username admin]`: the first admin user and an API key, made without a prompt.

What `manage.py up` does on its first run, for a head started any other way (daphne behind a load balancer,
docs/operations.md, *Production layout*). Run again, it makes nothing and says how to get a new password or key.
"""

import os
import sys

from django.core.management.base import BaseCommand, CommandError

from api.services import FirstAdmin, first_admin_create


class Command(BaseCommand):
    help = ("Create the first admin user (random password) and an API key, printed once, with no prompt; "
            "when an admin exists, create nothing and say how to reset its password or make a key.")

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin", help="the admin's user name (admin)")

    def handle(self, *args, **options):
        try:
            made = first_admin_create(username=options["username"])
        except ValueError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        if not made.created:
            self.stdout.write(f"An admin user exists already ({made.username}): nothing was made.\n")
            self.stdout.write(lost_credentials_line(made.username))
            return
        self.stdout.write(first_admin_lines(made))


def first_admin_lines(made: FirstAdmin, base: str = "") -> str:
    """The credentials, shown this once; `base` (the head's URL, when known) puts the admin's address before them."""
    admin = f"{base}/admin/   " if base else ""
    return ("\nFirst run: an admin user and an API key were created. They are shown only this once.\n"
            f"  admin:     {admin}user {made.username}   password {made.password}\n"
            + (f"  fleet:     {base}/admin/fleet/\n" if base else "")
            + f"  API key:   {made.key}\n"
            f"  in shells: export KEY={made.key}   (the README's examples send $KEY)\n")


def lost_credentials_line(username: str) -> str:
    """Later runs show no password or key (only hashes are kept): they say how to make new ones."""
    manage = f"{shown_python()} manage.py"
    return (f"Lost the admin password? {manage} changepassword {username}   "
            f"A new API key: {manage} create_api_key --user {username} --name NAME\n")


def shown_python() -> str:
    """This interpreter as a user would type it: `.venv/bin/python` run from the clone, else its full path."""
    relative = os.path.relpath(sys.executable)
    return sys.executable if relative.startswith("..") else relative
