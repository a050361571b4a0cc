// sparkform's combined front port, run by nginx's njs module (Debian's libnginx-mod-http-js):
// the request's "model" picks the engine that serves that name, and GET /v1/models lists every
// served name. nginx checks the key before this runs (rewrite phase) and proxies after it (a
// named location per engine), so this only reads the body and chooses; it never sees a
// response. The table comes from the front's config ($sparkform_front_table, rendered from the
// inventory): {"models": {NAME: ENGINE}, "engines": {ENGINE: {"routes": [...], "limit": BYTES,
// "window": TOKENS}}}.

function table(r) {
    return JSON.parse(r.variables.sparkform_front_table);
}

// An error in the OpenAI shape (the Anthropic SDK reads error.message from it too).
function refuse(r, status, type, message) {
    r.headersOut['Content-Type'] = 'application/json';
    r.return(status, JSON.stringify({error: {message: message, type: type, code: status}}) + '\n');
}

function servedList(front) {
    return Object.keys(front.models).sort().join(', ');
}

// POST routes that carry "model" in their JSON body: to that model's engine, or an error.
function route(r) {
    const front = table(r);
    const body = r.requestBuffer;
    if (body === undefined) {
        // nginx wrote it to a file: bigger than every engine's limit (client_body_buffer_size).
        return refuse(r, 413, 'invalid_request_error', 'the request body is over every engine\'s limit');
    }
    let model;
    try {
        model = JSON.parse(body.toString()).model;
    } catch (e) {
        return refuse(r, 400, 'invalid_request_error', 'the request body is not JSON');
    }
    const engine = typeof model === 'string' && Object.prototype.hasOwnProperty.call(front.models, model)
        ? front.engines[front.models[model]] : undefined;
    if (engine === undefined) {
        const asked = typeof model === 'string' ? `model '${model}' is not served here` : 'the request names no model';
        return refuse(r, 404, 'not_found_error', `${asked}; served models: ${servedList(front)}`);
    }
    if (engine.routes.indexOf(r.uri) < 0) {
        return refuse(r, 404, 'not_found_error', `model '${model}' does not serve ${r.uri}`);
    }
    if (body.length > engine.limit) {
        return refuse(r, 413, 'invalid_request_error',
            `the request body (${body.length} bytes) is over model '${model}''s limit (${engine.limit} bytes)`);
    }
    r.internalRedirect('@sparkform_' + front.models[model]);
}

// GET /v1/models: every served name of every engine, with its window, as vLLM lists its own.
function models(r) {
    const front = table(r);
    const data = Object.keys(front.models).sort().map(name => ({
        id: name,
        object: 'model',
        owned_by: 'vllm',
        max_model_len: front.engines[front.models[name]].window,
    }));
    r.headersOut['Content-Type'] = 'application/json';
    r.return(200, JSON.stringify({object: 'list', data: data}) + '\n');
}

export default {route, models};
