// A local OAuth 2.0 authorization server for Tether's tests, on
// `oauth2-mock-server` (its authorize redirect, signed tokens and token
// responses), made as strict as a real server where the package is lenient.
//
//   node server.mjs PORT [--client ID:SECRET]...
//
// PORT 0 takes any free port. Prints one line, `listening http://127.0.0.1:PORT`,
// then serves until its stdin closes (a test that dies takes it along).
//
// Clients: one given with `--client` is confidential and must authenticate
// at /token with HTTP Basic (RFC 6749 §2.3.1, id and secret form-urlencoded).
// Any other client_id is a public client and must send its client_id in
// the body, with no secret.
//
// What it adds to the package (8.2.x), which
//   - checks the PKCE verifier only when one is sent (leaving the code out
//     skips the check), and answers a wrong one with `invalid_request`;
//   - forgets nothing else about a code: a code without PKCE, or a reused
//     one sent without a verifier, is accepted;
//   - accepts any refresh token, and checks no client secret;
//   - grants the `scope` of the token request ("dummy" when there is none):
// here, /authorize requires `response_type=code`, a client_id, and an S256
// code_challenge; a code is good once, for its client and redirect_uri, and
// only with the verifier of its challenge (else 400 `invalid_grant`, as
// RFC 6749 §5.2 and RFC 7636 §4.6 say); refresh tokens rotate (each use
// gives a new one and spends the old one); and the granted scope is the one
// of the authorization request.
//
// Test routes:
//   GET  /stats    -> {"authorization_code": n, "refresh_token": m}: token
//                     requests received of each grant type, refused ones too.
//   POST /control  JSON {"expires_in": seconds, "refresh_delay_ms": ms}:
//                  the lifetime of the tokens issued from then on (default
//                  3600), and how long a refresh is held before it is
//                  answered (default 0), each optional.

import { createHash, randomUUID, timingSafeEqual } from 'node:crypto';
import { createServer } from 'node:http';

import express from 'express';
import { OAuth2Issuer, OAuth2Service } from 'oauth2-mock-server';

const args = process.argv.slice(2);
const port = Number(args.shift() ?? '0');
if (!Number.isInteger(port) || port < 0 || port > 65535) {
  console.error('usage: node server.mjs PORT [--client ID:SECRET]...');
  process.exit(2);
}
/** client_id -> secret, for confidential clients. */
const confidential = new Map();
while (args.length > 0) {
  const flag = args.shift();
  const value = args.shift() ?? '';
  const colon = value.indexOf(':');
  if (flag !== '--client' || colon < 1) {
    console.error(`unexpected argument ${flag} ${value}`);
    process.exit(2);
  }
  confidential.set(value.slice(0, colon), value.slice(colon + 1));
}

/** code -> {clientId, redirectUri, challenge, scope}, until it is used. */
const codes = new Map();
/** refresh token -> {clientId, scope}, until it is used. */
const refreshTokens = new Map();
const stats = { authorization_code: 0, refresh_token: 0 };
let expiresIn = 3600;
/** How long a refresh is held before it is answered, in milliseconds. */
let refreshDelayMs = 0;

const issuer = new OAuth2Issuer();
await issuer.keys.generate('RS256');
const service = new OAuth2Service(issuer);

function refuse(res, status, error, description) {
  res.status(status).set('Cache-Control', 'no-store').json({ error, error_description: description });
}

function same(a, b) {
  const x = Buffer.from(String(a));
  const y = Buffer.from(String(b));
  return x.length === y.length && timingSafeEqual(x, y);
}

/**
 * The client a token request comes from, after checking how it
 * authenticates; undefined when it has been refused.
 */
function authenticate(req, res) {
  const header = req.get('authorization');
  if (header !== undefined) {
    const [scheme, encoded] = header.split(' ');
    const decoded = scheme?.toLowerCase() === 'basic' ? Buffer.from(encoded ?? '', 'base64').toString() : '';
    const colon = decoded.indexOf(':');
    if (colon < 0) {
      refuse(res, 401, 'invalid_client', 'unreadable Authorization header');
      return undefined;
    }
    // RFC 6749 §2.3.1: both parts are form-urlencoded before Basic encoding.
    const unform = (s) => decodeURIComponent(s.replace(/\+/g, ' '));
    const id = unform(decoded.slice(0, colon));
    const secret = unform(decoded.slice(colon + 1));
    if (!confidential.has(id) || !same(confidential.get(id), secret)) {
      refuse(res, 401, 'invalid_client', 'client authentication failed');
      return undefined;
    }
    if (req.body.client_id !== undefined && req.body.client_id !== id) {
      refuse(res, 400, 'invalid_request', 'client_id differs from the authenticated client');
      return undefined;
    }
    return id;
  }
  const id = req.body.client_id;
  if (typeof id !== 'string' || id === '') {
    refuse(res, 401, 'invalid_client', 'no client authentication and no client_id');
    return undefined;
  }
  if (confidential.has(id)) {
    refuse(res, 401, 'invalid_client', 'this client must authenticate');
    return undefined;
  }
  if (req.body.client_secret !== undefined) {
    refuse(res, 401, 'invalid_client', 'a public client has no secret');
    return undefined;
  }
  return id;
}

/** Checks a code exchange; the grant it makes, or undefined when refused. */
function codeGrant(req, res, clientId) {
  const { code, code_verifier: verifier, redirect_uri: redirectUri } = req.body;
  const grant = codes.get(code);
  // A code is spent by its first use, whatever the outcome (RFC 6749 §4.1.2).
  codes.delete(code);
  if (grant === undefined) {
    refuse(res, 400, 'invalid_grant', 'unknown or already used code');
    return undefined;
  }
  if (grant.clientId !== clientId) {
    refuse(res, 400, 'invalid_grant', 'the code was issued to another client');
    return undefined;
  }
  if (grant.redirectUri !== redirectUri) {
    refuse(res, 400, 'invalid_grant', 'redirect_uri differs from the authorization request');
    return undefined;
  }
  if (typeof verifier !== 'string' || !/^[A-Za-z0-9._~-]{43,128}$/.test(verifier)) {
    refuse(res, 400, 'invalid_grant', 'missing or malformed code_verifier');
    return undefined;
  }
  const challenge = createHash('sha256').update(verifier).digest('base64url');
  if (!same(challenge, grant.challenge)) {
    refuse(res, 400, 'invalid_grant', 'code_verifier does not match the code_challenge');
    return undefined;
  }
  return { clientId, scope: grant.scope };
}

/** Checks a refresh; the grant it makes, or undefined when refused. */
function refreshGrant(req, res, clientId) {
  const token = req.body.refresh_token;
  const grant = refreshTokens.get(token);
  if (grant === undefined || grant.clientId !== clientId) {
    refuse(res, 400, 'invalid_grant', 'unknown or already used refresh token');
    return undefined;
  }
  refreshTokens.delete(token);
  // A refresh may narrow the scope, never widen it (RFC 6749 §6).
  let scope = grant.scope;
  if (typeof req.body.scope === 'string') {
    const granted = new Set(grant.scope.split(' '));
    const asked = req.body.scope.split(' ').filter((s) => s !== '');
    if (!asked.every((s) => granted.has(s))) {
      refuse(res, 400, 'invalid_scope', 'more scope than was granted');
      return undefined;
    }
    scope = asked.join(' ');
  }
  return { clientId, scope };
}

const app = express();
app.disable('x-powered-by');

app.get('/stats', (_req, res) => res.json(stats));

app.post('/control', express.json(), (req, res) => {
  const seconds = req.body?.expires_in ?? expiresIn;
  const delay = req.body?.refresh_delay_ms ?? refreshDelayMs;
  if (!Number.isInteger(seconds) || seconds < 1) {
    refuse(res, 400, 'invalid_request', 'expires_in must be a positive integer');
    return;
  }
  if (!Number.isInteger(delay) || delay < 0) {
    refuse(res, 400, 'invalid_request', 'refresh_delay_ms must be a non-negative integer');
    return;
  }
  expiresIn = seconds;
  refreshDelayMs = delay;
  res.json({ expires_in: expiresIn, refresh_delay_ms: refreshDelayMs });
});

app.get('/authorize', (req, res, next) => {
  const { response_type: type, client_id: clientId, code_challenge: challenge } = req.query;
  const method = req.query.code_challenge_method;
  if (type !== 'code' || typeof clientId !== 'string' || clientId === '') {
    refuse(res, 400, 'invalid_request', 'response_type=code and a client_id are required');
    return;
  }
  if (typeof req.query.redirect_uri !== 'string') {
    refuse(res, 400, 'invalid_request', 'redirect_uri is required');
    return;
  }
  if (typeof challenge !== 'string' || method !== 'S256') {
    refuse(res, 400, 'invalid_request', 'PKCE with code_challenge_method=S256 is required');
    return;
  }
  next();
});

// The package redirects with a new code; remember what it was issued for.
service.on('beforeAuthorizeRedirect', (redirect, req) => {
  const code = redirect.url.searchParams.get('code');
  if (code === null) return;
  codes.set(code, {
    clientId: req.query.client_id,
    redirectUri: req.query.redirect_uri,
    challenge: req.query.code_challenge,
    scope: typeof req.query.scope === 'string' ? req.query.scope : '',
  });
});

app.post('/token', express.urlencoded({ extended: false }), (req, res, next) => {
  const type = req.body?.grant_type;
  if (type in stats) stats[type] += 1;
  if (type !== 'authorization_code' && type !== 'refresh_token') {
    refuse(res, 400, 'unsupported_grant_type', 'only authorization_code and refresh_token');
    return;
  }
  const clientId = authenticate(req, res);
  if (clientId === undefined) return;
  const grant = type === 'authorization_code' ? codeGrant(req, res, clientId) : refreshGrant(req, res, clientId);
  if (grant === undefined) return;
  // The package reads these: its own PKCE check is satisfied already, and
  // the scope it grants is the one set here.
  req.grant = grant;
  req.body.scope = grant.scope;
  if (type === 'refresh_token' && refreshDelayMs > 0) {
    setTimeout(next, refreshDelayMs);
  } else {
    next();
  }
});

service.on('beforeTokenSigning', (token) => {
  token.payload.exp = token.payload.iat + expiresIn;
  // Tokens signed in the same second would otherwise be the same.
  token.payload.jti = randomUUID();
});

service.on('beforeResponse', (response, req) => {
  if (response.statusCode !== 200 || req.grant === undefined) return;
  const refreshToken = randomUUID();
  refreshTokens.set(refreshToken, req.grant);
  response.body.refresh_token = refreshToken;
  response.body.expires_in = expiresIn;
  response.body.scope = req.grant.scope;
});

// The body is parsed above; the package's parser sees it is read and keeps it.
app.use(service.requestHandler);

const server = createServer(app);
server.listen(port, '127.0.0.1', () => {
  const { port: bound } = server.address();
  issuer.url = `http://127.0.0.1:${bound}`;
  process.stdout.write(`listening ${issuer.url}\n`);
});

process.stdin.on('end', () => process.exit(0));
process.stdin.on('close', () => process.exit(0));
process.stdin.resume();
