"""API tokens are credentials: not listed in the admin, where any staff user could read them."""
from django.contrib import admin
from rest_framework.authtoken.models import TokenProxy

if admin.site.is_registered(TokenProxy):
    admin.site.unregister(TokenProxy)
