SUMMARY = "A minimal image that boots into herald, the speaking appliance"
DESCRIPTION = "core-image-minimal plus herald (started by systemd as herald.service), \
               alsa-utils, and the model bundle of herald-bundle-local when \
               HERALD_BUNDLE_DIR is set."
# The homepage check needs the network, and the URL is a placeholder (see herald_0.1.0.bb).
# nooelint: oelint.vars.homepageping
HOMEPAGE = "https://example.invalid/herald"
BUGTRACKER = "https://example.invalid/herald/issues"
SECTION = "images"
LICENSE = "MIT"

# oelint-adv lints this layer alone and cannot see oe-core, where this file lives
# (meta/recipes-core/images/core-image-minimal.bb, on BBPATH in every build).
# nooelint: oelint.file.requirenotfound
require recipes-core/images/core-image-minimal.bb

# herald runs as a systemd service (Type=notify, watchdog, DynamicUser). nodistro's default
# INIT_MANAGER is systemd on wrynose; poky's is not: set INIT_MANAGER = "systemd" there.
inherit features_check
REQUIRED_DISTRO_FEATURES = "systemd"

IMAGE_INSTALL:append = " herald alsa-utils ${@'herald-bundle-local' if d.getVar('HERALD_BUNDLE_DIR') else ''}"

CVE_PRODUCT = ""
