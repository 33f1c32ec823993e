"""`manage.py create_api_key --user U --name N [--tokens-per-day T ...] [--priority P --weight W --max-waiting N]`:
make an API key and print it once."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from api.models import ApiKey
from api.services import api_key_create


class Command(BaseCommand):
    help = "Create an API key for a user; the key is printed once and only its hash is kept."

    def add_arguments(self, parser):
        parser.add_argument("--user", required=True, help="username that owns the key")
        parser.add_argument("--name", required=True, help="what the key is for")
        for field in ApiKey.QUOTA_FIELDS:
            parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=None, metavar="N",
                                help=f"the key's own {field.replace('_', ' ')} (default: FLEET_QUOTA_"
                                f"{field.upper()}; 0: unlimited)")
        parser.add_argument("--priority", choices=ApiKey.Priority.values, default=None,
                            help="its class when every lane is busy (default: normal)")
        parser.add_argument("--weight", type=int, default=None, metavar="W",
                            help="its share of freed lanes against its class's other keys, 1-100 (default: 1)")
        parser.add_argument("--max-waiting", type=int, default=None, metavar="N", help="generations it may have "
                            "waiting for a lane (default: FLEET_MAX_WAITING_PER_KEY; 0: unbounded)")

    def handle(self, *args, **options):
        user = get_user_model().objects.filter(username=options["user"]).first()
        if user is None:
            raise CommandError(
                f"no user named {options['user']!r}; create one with `manage.py createsuperuser`", returncode=2
            )
        negative = [f for f in (*ApiKey.QUOTA_FIELDS, "max_waiting") if (options[f] or 0) < 0]
        if negative:
            raise CommandError(f"--{negative[0].replace('_', '-')} must be 0 (unlimited) or more", returncode=2)
        if options["weight"] is not None and not 1 <= options["weight"] <= 100:
            raise CommandError("--weight must be from 1 to 100", returncode=2)
        try:
            key, secret = api_key_create(owner=user, name=options["name"],
                                         quotas={f: options[f] for f in (*ApiKey.QUOTA_FIELDS, *ApiKey.SHARE_FIELDS)})
        except ValueError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        self.stdout.write(f"API key {key.name!r} created for {user.get_username()} (prefix {key.prefix}).\n")
        self.stdout.write(f"  {secret}\nIt is shown only this once. Use it as: Authorization: Bearer <key>\n")
